"""Transport backends: the contract in `backends.base`, one module per backend, loaded lazily."""
