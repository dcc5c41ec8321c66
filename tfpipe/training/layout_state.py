"""Training state keyed by the user's model, not by the pipeline's layout.

A checkpoint names each value after what it belongs to in the Keras model: a
weight by its variable's path ("llama_backbone/transformer_layer_0/.../kernel"),
an optimizer slot by its weight's path and the slot's own name (Keras names a
slot `{path with "/" -> "_"}_{slot}`, e.g. "..._kernel_momentum"), and the
optimizer's own counters (its step, a loss scale) by their names. So a
checkpoint written with K stages restores into any other K, any method and
the plain Keras model with its compiled optimizer (`restore_keras`): the
stages only decide which of these variables live where.

A path the model holds twice (two `SeedGenerator`s of one name) is told apart
by its place in `model.variables` ("path#2"); a weight several stages hold (a
tied embedding) is saved once, from its first stage, and copied into the
others after a restore. Method state that exists for some methods only
(PipeMare's average weight change, 2BW's previous weights) is kept by path too
and restored where both methods have it.
"""

import collections

import tensorflow as tf

__all__ = ["variable_keys", "slot_keys", "StageState", "keras_state"]


def variable_keys(model):
  """{id(model variable): key}: its path, "#n" added for the n-th repeat of a path."""
  seen, keys = collections.Counter(), {}
  for v in model.variables:
    if id(v) in keys:
      continue
    path = v.path
    seen[path] += 1
    keys[id(v)] = path if seen[path] == 1 else f"{path}#{seen[path]}"
  return keys


def _slot_name(variable):
  return variable.path.replace("/", "_") + "_"


def slot_keys(optimizer, references):
  """The optimizer's variables as ({slot key: variable}, {own key: variable}).

  `references`: [(key of the weight, the variable the optimizer was built over)]. A slot is
  an optimizer variable whose name starts with its reference's sanitised path (Keras's
  `add_variable_from_reference`) and has its shape; the longest such path wins, and slots
  of references of one name are given out in the references' order, as Keras creates them.
  The slot key is "{weight key}/{slot}". The rest (the step, the learning rate, a loss
  scale's variables) are the optimizer's own, keyed by name ("#n" for a repeat)."""
  slots, own, named = {}, {}, collections.Counter()
  taken = collections.defaultdict(set)   # reference index -> slot names given to it
  prefixes = [(_slot_name(ref), j, tuple(ref.shape)) for j, (_, ref) in enumerate(references)]
  for variable in optimizer.variables:
    name, shape = variable.name, tuple(variable.shape)
    candidates = [(len(prefix), -j, name[len(prefix):]) for prefix, j, ref_shape in prefixes
                  if name.startswith(prefix) and ref_shape == shape
                  and name[len(prefix):] not in taken[j]]
    if not candidates:
      named[name] += 1
      own[name if named[name] == 1 else f"{name}#{named[name]}"] = variable
      continue
    _, minus_j, slot = max(candidates)
    taken[-minus_j].add(slot)
    slots[f"{references[-minus_j][0]}/{slot}"] = variable
  return slots, own


class StageState:
  """The variables of the pipeline's stages under layout-free keys: `weights`, `slots`,
  `optimizer` (the counters, from stage 0), `method` (PipeMare's deltas, 2BW's previous
  weights) and `copies`: [(saved variable, another stage's copy of it)] to fill after a
  restore."""

  def __init__(self, model, programs):
    keys = variable_keys(model)
    self.weights, self.slots, self.optimizer, self.method = {}, {}, {}, {}
    self.copies = []
    unread = []   # a weight's copy on a stage that holds it but does not read it: put last
    for k, program in enumerate(programs):
      pairs = program.model_pairs
      n = len(program.trainable)
      references = [(keys[id(src)], own) for src, own in pairs[:n]]
      idle = {references[j][0] for j in program.unread}

      def put(table, key, variable, weight, idle=idle):
        if weight in idle:
          unread.append((table, key, variable))
        else:
          self._put(table, key, variable)

      for src, own in pairs:
        put(self.weights, keys[id(src)], own, keys[id(src)])
      slots, counters = slot_keys(program.optimizer, references)
      for key, variable in slots.items():
        put(self.slots, key, variable, key.rsplit("/", 1)[0])
      for key, variable in counters.items():
        self._put(self.optimizer, key, variable)
      for kind, values in (("delta", program.sources.deltas),
                           ("previous", program.sources.previous)):
        for (key, _), variable in zip(references, values):
          put(self.method, f"{key}/{kind}", variable, key)
    for table, key, variable in unread:
      self._put(table, key, variable)

  def _put(self, table, key, variable):
    if key in table:
      self.copies.append((table[key], variable))
    else:
      table[key] = variable

  def fill_copies(self):
    """Every other stage's copy := the value restored into the first."""
    for saved, copy in self.copies:
      copy.assign(tf.convert_to_tensor(saved))


def keras_state(model):
  """The Keras model's variables and its compiled optimizer's under the same keys
  (`restore_keras`): ({weight key: variable}, {slot key: variable}, {own key: variable})."""
  if getattr(model, "optimizer", None) is None:
    raise ValueError(f"compile model {model.name!r} with its optimizer before restoring a "
                     "pipeline's checkpoint into it: the checkpoint holds the optimizer's state")
  keys = variable_keys(model)
  trainable = model.trainable_variables
  if not model.optimizer.built:
    model.optimizer.build(trainable)
  weights = {keys[id(v)]: v for v in model.variables}
  slots, own = slot_keys(model.optimizer, [(keys[id(v)], v) for v in trainable])
  return weights, slots, own
