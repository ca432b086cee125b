"""The bench (`bash run.sh bench`, NOTES.md): throughput of this project's DINO step, data
path, inference, k-NN and linear probe, against reference implementations and the machine's
measured ceilings, and the scripts that say why (profile) and what a setting costs. A tool for
measuring the project, not a part of the installed package: run.sh puts tools/ on the import
path and runs `python -m bench`; the campaign (tools/campaign) runs its stages the same way.

  bench.py      the command: the rows in order, resumable, the tables, the goals (FAMILIES)
  config.py     bench.yaml and profile.yaml beside it, through the package's loader
  step.py       the step kit every row of the DINO step shares; it imports no family
  dino.py, e2e.py, torchrun_step.py, inference.py, knn.py, linear.py, data.py   the families of rows
  reference.py  the reference DINO step the dino row compares against
  timing.py     timing, memory and the measured ceilings (matmul, copy)
  jpegs.py      synthetic photo-like JPEG folders (the e2e row, the campaign's tiny data)
  process.py    how the bench starts a process of its own (torchrun, compile_cost, the k-NN baseline)
  profile.py, kernel_classes.py   where a step's (or the k-NN's) time goes, kernels by class
  compile_cost.py, head_cost.py, checkpoint_cost.py   what compilation, the head's precision
                and a checkpoint cost (`python -m bench.<script>`)
"""
