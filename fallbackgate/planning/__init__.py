"""`fallbackgate plan`: will a model run in a budget, how fast, and with which fallbacks."""
