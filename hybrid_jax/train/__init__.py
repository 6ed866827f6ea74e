"""Training for hybrid-jax models: `hybrid-jax train` (or `python -m hybrid_jax.train`).

  config.py      TrainConfig (optimiser, batch, schedule, evaluation and checkpoint cadence)
  data.py        files -> de-duplicated corpus -> BPE tokenizer -> packed rows; held-out split
  dataset.py     one run's prepared data (tokenizer.json and corpus.json in the run directory)
  step.py        jitted train/eval steps: bf16 compute over f32 master weights, AdamW, data parallel
  checkpoint.py  orbax checkpoints for exact resume; export to a native model directory
  loop.py        the loop: resume, log, evaluate, checkpoint, export
  progress.py    progress bar and the JSON-lines run log
  corpus.py      the default model's corpus (the Python standard library)
  cli.py         `hybrid-jax train` arguments and checks
"""
