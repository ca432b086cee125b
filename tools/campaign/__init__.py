"""The GPU campaign (`bash run.sh campaign`, tools/campaign/README.md): this project's
whole measurement on a borrowed GPU machine, one resumable call after another. A tool for
measuring the project, not a part of the installed package: run.sh puts tools/ on the
import path and runs `python -m campaign`; the stages it runs are the package's commands
and the bench's (tools/bench).

  call.py      one call: the stages under the call's deadline and the window's, the report
  config.py    the campaign's keys: campaign.yaml beside it, through the package's loader
  plan.py      which stages, of which kind, with what keys (campaign.yaml)
  stages.py    what every kind of stage shares, and when one may start
  tests.py, bench.py, costs.py, training.py   the kinds: the CUDA tests; bench lines and
               profiles; the bench's cost scripts (compile_cost.py cold and warm,
               head_cost.py); the training runs (the preset, compare) and their predicted
               time (predict.py)
  state.py     what a call keeps for the next one on the same machine (campaign.json)
  report.py    what the report folder holds, and a fresh machine's start from a carried one
  folder.py    writing that folder within what a lent machine hands back
  setup.sh     a bare machine's set-up before any Python runs (run.sh's campaign case sources it)
  carry.sh     what such a machine needs, made here (`bash run.sh campaign-carry`)
"""
