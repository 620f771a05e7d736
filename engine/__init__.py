"""The engine: config, CLI, launcher, parameter-server server and client, training modes, worker loop,
metrics, checkpoint scheduling and export. It composes the other packages and nothing imports it."""
