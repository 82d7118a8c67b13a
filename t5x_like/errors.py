"""The error every layer may raise for bad input: a leaf module, so that the config, the mesh,
the attention checks and the command-line tools share it without importing each other."""


class ConfigError(ValueError):
  """A configuration problem, with a message that names the key and the fix."""
