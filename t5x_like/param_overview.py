"""The start-up log's parameter table, from `clu.parameter_overview`."""

from __future__ import annotations

from typing import Any

from clu import parameter_overview


def parameter_table(params: Any) -> list[str]:
  """Lines of clu's table of `params` (arrays or ShapeDtypeStructs with their shardings): each
  parameter's name, shape, dtype, size and sharding (the mesh axes splitting each dimension),
  then the totals. Reads shapes and shardings only: nothing runs on the devices."""
  table = parameter_overview.get_parameter_overview(params, include_stats='sharding')
  return ['> parameters as the train step holds them (clu.parameter_overview):',
          *table.splitlines()]
