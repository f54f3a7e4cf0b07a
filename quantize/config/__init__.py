"""Config machinery: pydantic models whose fields carry their limits and help, and the JSON Schema and defaults
files made from them."""
