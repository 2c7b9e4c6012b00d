"""What other libraries' training loops need of an optimized module, in one place.

- ``hf_trainer``: Hugging Face transformers. The optimized module of a ``PreTrainedModel`` keeps
  the interface ``Trainer`` reads (``config``, ``save_pretrained``, ...), and
  ``pretrained_checkpoints()`` completes the checkpoints ``Trainer`` writes.
- ``call_guard``: the one forward pre-hook ``optimize`` puts on the module it returns. Before any
  compute it refuses what a script attached to a submodule that would not run as on the user's
  model: hooks on a module the graph never calls or a region recomputes, and (``fsdp``) a module
  sharded with FSDP2 where the graph never calls it.

At the API level: it composes the layers below (``fxopt.api`` calls it) and nothing below
imports it. Importing it does not import transformers.
"""
