"""The round engine: how one Lightning epoch becomes one communication round.

Read top-down:

- :mod:`.strategy`: ``FederatedStrategy``, the Lightning-facing part (launch, process
  group, Lightning's per-step hooks, checkpoint I/O). It hands the round's work to:
- :mod:`.planning`: who trains this round (sampler, clients without data, CA-Fed's
  loss probes), their loaders, this rank's schedule of steps and vectorized chunks;
- :mod:`.round_engine`: the client life cycle (start, fold in the update, drop a NaN
  update), the round's all-reduce, aggregation and the federated callbacks' hook order;
- :mod:`.driver`: the callback that finishes clients after their last optimizer step,
  logs the round's summaries and carries the federated state in checkpoints;
- :mod:`.federated_state`: what a checkpoint holds, and the federation check on resume;
- :mod:`.rounds`: the per-round iterables that Lightning's loops consume;
- :mod:`.vectorized`: vectorized clients (``vectorize=True``): set-up, chunks, the step;
- :mod:`.evaluation`: per-client validation and test, and their summaries;
- :mod:`.composition`: which plugin pairs are refused at setup;
- helpers shared with the plugins: :mod:`.client_store`, :mod:`.tensors`,
  :mod:`.seeding`, :mod:`.local_training`, :mod:`.divergence`, :mod:`.progress`,
  :mod:`.outputs`.
"""
