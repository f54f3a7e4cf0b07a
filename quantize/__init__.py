"""The library under the build and the server; imports nothing else of the project. Sub-packages, each importing only
those listed before it: ``config``, ``model``, ``runtime``, ``calibration``, (``recipes``, ``recipe_types``),
``fidelity``, ``w8a8``, ``export``, ``reference``."""
