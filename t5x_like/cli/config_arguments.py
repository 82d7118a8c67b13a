"""The config arguments of the commands that take a run's config (train, plan): a Python config
file with --config.KEY=VALUE overrides, or gin files with --gin_bindings."""

from __future__ import annotations

import argparse

from t5x_like.config import Config, ConfigError, load_config_file, load_gin, parse_overrides


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
  """--config, --gin_file and --gin_bindings; the --config.KEY=VALUE overrides are the
  arguments parse_known_args leaves."""
  parser.add_argument('--config', help='ml_collections config file (configs/*.py)')
  parser.add_argument('--gin_file', action='append', default=[], help='gin file (repeatable)')
  parser.add_argument(
    '--gin_bindings',
    action='append',
    default=[],
    help="gin binding such as 'train.steps = 10' (repeatable)",
  )


def config_from_arguments(args: argparse.Namespace, rest: list[str]) -> Config:
  """The config the arguments name (not yet checked: startup.check_config does that)."""
  overrides = parse_overrides(rest)
  if bool(args.config) == bool(args.gin_file):
    raise ConfigError('pass exactly one of --config FILE.py or --gin_file FILE.gin')
  if args.gin_file:
    if overrides:
      raise ConfigError('--config.* overrides go with --config; with gin use --gin_bindings')
    return load_gin(args.gin_file, args.gin_bindings)
  return load_config_file(args.config, overrides)
