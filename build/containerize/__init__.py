"""``policy-bundle containerize``: the bento as an OCI image built by BentoML's own ``bentoml containerize``.

``base_image`` makes the local Debian base (no registry needed), ``bentofile`` writes the build-time bentofile
that points the bento at it and ships the CPU torch wheel, ``image`` runs ``bentoml build`` and
``bentoml containerize``, ``bento_models`` verifies the models a bento carries (also inside the image).
"""
