"""The `pdserve` command line and the probe: entry points that bring up and drive a deployment."""
