"""Adapters: tuners (search, optuna, hyperopt, hyperband) and model frameworks (lightning).

Installed as ``cerebro_automl.adapters``; each adapter imports its library lazily.
"""
