"""Text for the language models: characters as tokens, next-character prediction.

`grammar_text` is made here, offline: sentences drawn from a small English grammar (fixed
seed), so a model can learn its words and agreement. `tiny_shakespeare` is TensorFlow
Datasets' (downloaded where the machine can; elsewhere a clear error says how to provide
it). Both become windows of `sequence_length + 1` characters: the model reads the first
`sequence_length` ("token_ids", with an all-ones "padding_mask", as KerasHub backbones take
them) and predicts each next one.
"""

import numpy as np
import tensorflow as tf

__all__ = ["TEXT_DATASETS", "grammar", "windows", "from_text"]

TEXT_DATASETS = ("grammar_text", "tiny_shakespeare")
GRAMMAR_CHARACTERS = 400_000   # about 3,000 windows of 128

_SUBJECTS = {"singular": ["the cat", "a dog", "the old man", "my sister", "the river",
                          "a small bird", "the teacher", "the ship", "our neighbour"],
             "plural": ["the cats", "two dogs", "the children", "my friends", "the rivers",
                        "many birds", "the sailors", "the teachers", "our neighbours"]}
_VERBS = {"singular": ["sees", "follows", "likes", "finds", "watches", "carries", "remembers"],
          "plural": ["see", "follow", "like", "find", "watch", "carry", "remember"]}
_INTRANSITIVE = {"singular": ["sleeps", "runs", "sings", "waits", "laughs"],
                 "plural": ["sleep", "run", "sing", "wait", "laugh"]}
_OBJECTS = ["the ball", "a letter", "the garden", "an apple", "the moon", "a red boat",
            "the door", "some bread", "the long road"]
_PLACES = ["in the morning", "by the sea", "at night", "under the tree", "near the house",
           "after the rain"]


def grammar(characters=GRAMMAR_CHARACTERS, seed=1234):
  """`characters` of text from the grammar: sentences whose verbs agree with their subjects,
  some with an object, some with a place, joined by spaces."""
  rng = np.random.default_rng(seed)
  pick = lambda items: items[rng.integers(len(items))]
  sentences, size = [], 0
  while size < characters:
    number = pick(["singular", "plural"])
    if rng.random() < 0.6:
      words = [pick(_SUBJECTS[number]), pick(_VERBS[number]), pick(_OBJECTS)]
    else:
      words = [pick(_SUBJECTS[number]), pick(_INTRANSITIVE[number])]
    if rng.random() < 0.4:
      words.append(pick(_PLACES))
    sentence = " ".join(words)
    sentence = sentence[0].upper() + sentence[1:] + "."
    sentences.append(sentence)
    size += len(sentence) + 1
  return " ".join(sentences)[:characters]


def windows(ids, length):
  """Non-overlapping windows of `length + 1` token ids from the 1-D array `ids`."""
  count = (len(ids) - 1) // length
  starts = np.arange(count) * length
  return np.stack([ids[s:s + length + 1] for s in starts]).astype("int32")


def _dataset(tokens, batch_size, shuffle_seed=None):
  inputs = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
  data = tf.data.Dataset.from_tensor_slices((inputs, tokens[:, 1:]))
  if shuffle_seed is not None:
    data = data.shuffle(len(tokens), seed=shuffle_seed, reshuffle_each_iteration=True)
  return data.batch(batch_size, drop_remainder=shuffle_seed is not None).prefetch(4)


def from_text(train_text, validation_text, length, batch_size, seed):
  """(train, validation, vocabulary size, training windows): character ids (0 is kept for
  padding; the characters of both texts, sorted, are 1..V-1), windows of `length + 1`."""
  vocabulary = sorted(set(train_text) | set(validation_text))
  index = {c: i + 1 for i, c in enumerate(vocabulary)}
  encode = lambda text: np.array([index[c] for c in text], "int32")
  train, validation = windows(encode(train_text), length), windows(encode(validation_text), length)
  if len(train) < batch_size or len(validation) < 1:
    raise ValueError(f"the text makes {len(train)} training windows of {length + 1} characters, "
                     f"fewer than --batch_size={batch_size}: lower --sequence_length or the "
                     "batch size")
  return (_dataset(train, batch_size, seed), _dataset(validation, batch_size),
          len(vocabulary) + 1, len(train))
