"""The router process: the BentoML service clients call (OpenAI endpoints, admin API, metrics), the choice of a
variant per request, the pool of variant workers with fail-over and admission, and the live canary."""
