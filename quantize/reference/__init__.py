"""The embedded reference policy: the verifiable addition task and the tiny Llama trained on it (shipped trained
in ``trained/``)."""
