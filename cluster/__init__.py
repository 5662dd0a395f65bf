"""The Ray cluster and the engine pools in it: bootstrap, pool membership, Prometheus discovery."""
