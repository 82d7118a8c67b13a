"""t5x_like/planning/hlo_text.py on the text XLA prints for a real compiled program: a loop of a
matmul with a tuple carry, as the step's layer scan is."""

import re

import jax
import jax.numpy as jnp
import pytest

from t5x_like.planning import hlo_text


def _loop(w, x):
  def body(_, carry):
    h, total = carry
    h = jnp.tanh(h @ w)
    return h, total + h.sum()

  return jax.lax.fori_loop(0, 3, body, (x, jnp.float32(0)))


@pytest.fixture(scope='module')
def text():
  w, x = jnp.ones((8, 8), jnp.bfloat16), jnp.ones((4, 8), jnp.bfloat16)
  return jax.jit(_loop).lower(w, x).compile().as_text()


def test_every_instruction_is_parsed_in_its_computation(text):
  module = hlo_text.parse_module(text)
  assert module.name == 'jit__loop'
  (entry,) = re.findall(r'^ENTRY %([\w.\-]+) ', text, re.M)
  assert module.entry == entry
  lines = [line for line in text.splitlines() if re.match(r'^\s+(ROOT )?%\S+ = ', line)]
  assert len(module.by_name) == len(lines) > 10
  assert sum(len(body) for body in module.computations.values()) == len(lines)
  for name, body in module.computations.items():
    assert all(i.computation == name for i in body)
    (root,) = [i for i in body if f'ROOT %{i.name} = ' in text]
    assert module.roots[name] is root

  (dot,) = [i for i in module.by_name.values() if i.opcode == 'dot']
  assert [module.type_of(o).split('{')[0] for o in dot.operands] == ['f32[4,8]', 'f32[8,8]']
  assert hlo_text.arrays(dot.type) == [('f32', (4, 8))]
  assert dot.attribute(r'lhs_contracting_dims=\{(\d+)\}') == '1'
  assert dot.op_name.endswith('/while/body/closed_call/dot_general')
  file, function = module.source_of(dot)  # the innermost Python frame of the matmul
  assert file.endswith('tests/test_hlo_text.py') and function == '_loop.<locals>.body'


def test_the_loop_is_a_tuple_that_calls_its_body_and_condition(text):
  module = hlo_text.parse_module(text)
  (loop,) = [i for i in module.by_name.values() if i.opcode == 'while']
  assert loop.dtype == 'tuple'
  body, condition = loop.attribute(r'body=%([\w.\-]+)'), loop.attribute(r'condition=%([\w.\-]+)')
  assert set(loop.called) == {body, condition} <= set(module.computations)
  (carry,) = loop.operands  # the called computations are attributes, not operands
  assert module.by_name[carry].opcode == 'tuple'
  elements = hlo_text.tuple_elements(loop.type)
  assert any(e.startswith('bf16[4,8]') for e in elements) and 's32[]' in elements
  assert hlo_text.array_bytes(loop.type) == sum(hlo_text.array_bytes(e) for e in elements)


def test_a_compact_tuple_element_has_its_get_tuple_elements_type(text):
  """Newer XLA prints '%while.3#1' for the get-tuple-element jaxlib 0.10.2 prints: each real
  get-tuple-element's type is what its compact form reads out of the tuple."""
  module = hlo_text.parse_module(text)
  elements = [i for i in module.by_name.values() if i.opcode == 'get-tuple-element']
  assert elements
  for gte in elements:
    index = gte.attribute(r'index=(\d+)')
    assert module.type_of(f'{gte.operands[0]}#{index}') == gte.type
    assert module.dtype_of(f'{gte.operands[0]}#{index}') == gte.dtype
  assert module.type_of('no-such-instruction#0') == ''


def test_text_that_is_not_a_module_is_one_error(text):
  with pytest.raises(ValueError, match='no ENTRY computation'):
    hlo_text.parse_module(text.replace('ENTRY ', ''))
  with pytest.raises(ValueError, match='no opcode after the type'):
    hlo_text.parse_module(text.replace(' = f32[4,8]{1,0} dot(', ' = f32[4,8]{1,0}'))
