"""What other libraries' training loops need of an optimized module, in one place.

- ``hf_trainer``: Hugging Face transformers. The optimized module of a ``PreTrainedModel`` keeps
  the interface ``Trainer`` reads (``config``, ``save_pretrained``, ...), and
  ``pretrained_checkpoints()`` completes the checkpoints ``Trainer`` writes.
- ``fsdp``: FSDP2. The forward pre-hook ``optimize`` puts on the module it returns refuses,
  before any compute, a module sharded where the optimized graph never calls it.

At the API level: it composes the layers below (``fxopt.api`` calls it) and nothing below
imports it. Importing it does not import transformers.
"""
