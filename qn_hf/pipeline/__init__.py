"""Pipeline parallelism, one concept per file:

* ``schedule.py``: schedules as pure data: the ``Schedule`` enum (1F1B, GPipe, interleaved 1F1B,
  ZB-H1, each knowing what it can do), the ``Op`` enum, ``Action``, each stage's ordered action list,
  the argument checks, a deadlock simulator and ``format_grid`` (a printable
  step x stage table of a whole schedule);
* ``split.py``: where a model is cut: ``StagePlan`` (blocks, entry, first/last-only modules, heads
  and cross-stage ties per stage), built and validated by ``build_stage_plan`` without communicating;
* ``seq2seq.py``: an encoder-decoder's pipeline (encoder stages, then decoder stages, the encoder's
  output travelling with the decoder's hidden states);
* ``stage.py``: what one rank's model becomes (``apply_stage`` -> ``StageModules``) and how that stage
  runs a microbatch (``StageModules.forward``);
* ``standins.py``: the parameter-free modules standing in for modules that live on another stage
  (``PassThrough``, ``PassThroughs`` for a list, ``Zeros``, the entry's ``Injector``), and the
  ``BlockRotation`` of outputs packed per block (what every stage computes before its blocks);
* ``stage_config.py``: a stage's own config copy with per-layer lists cut to its blocks;
* ``runtime.py``: ``StageExecutor``, which executes one stage's action list with point-to-point
  sends and receives and marks the failing action in the grid when one raises;
* ``p2p.py``: the links between neighbouring stages (``Peers``, ``Link``), one communicator per
  direction, and why;
* ``schedule_check.py``: schedules proven as data (deadlock, FIFO links, order, timing, peaks);
  ``nccl_replay.py``: recorded calls replayed under NCCL's stream semantics;
* ``wire.py``: the header that announces a tensor's shape and dtype;
* ``weight_grad.py``: ZB-H1's split backward: linear layers queue their input and output gradient in
  B, and the deferred W passes accumulate the weight gradients;
* ``costs.py``: what a schedule costs, for the planner: its makespan and bubble at per-op costs, each rank's
  activation peak over its action list.
"""
