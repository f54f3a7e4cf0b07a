"""The library under the build and the server; imports nothing else of the project. Sub-packages, each importing only
those listed before it: ``config``, ``model``, ``runtime``, ``calibration``, (``recipes``, ``recipe_types``),
``fidelity``, ``w8a8``, (``export``, ``front``), ``reference``. The front door is ``front.quantize(policy, config,
statistics)``: one frozen config type per scheme family, dispatched to its handler."""
