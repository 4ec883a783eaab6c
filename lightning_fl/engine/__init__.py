"""The round engine: how one Lightning epoch becomes one communication round.

Read top-down:

- :mod:`.strategy`: ``FederatedStrategy``, the Lightning-facing part (launch, process
  group, Lightning's per-step hooks, checkpoint I/O). At each set-up it builds the
  :class:`~.context.FitContext` and hands the round's work to the objects below, which
  are given that context, never the strategy (no module here imports it); what it does
  at set-up lives in :mod:`.fit_callbacks` (the Trainer's callbacks, completed and
  ordered; the fit's plugins), :mod:`.setup_checks` (what is refused or adjusted) and
  :mod:`.processes` (threads, the process group of a restarted worker, the SIGTERM
  check), and each training step's work in :mod:`.training_steps`;
- :mod:`.context`: what the engine reads: the frozen ``FederatedConfig``, the ranks, the
  federation (the one owner of every client's sample count), the fit's plugins;
- :mod:`.plugins`: the plugin contract (``FederatedCallback``, ``Aggregator``,
  ``RoundState``, ``FedAvg``): the engine never imports ``lightning_fl.callbacks``;
- :mod:`.data_contract`: the datamodule contract (``FederatedDataModule``,
  ``FederatedLoader``, ``PairedDataset``, the splits): the engine never imports
  ``lightning_fl.datamodules``;
- :mod:`.planning`: who trains this round (sampler, clients without data, CA-Fed's
  loss probes), their loaders, this rank's schedule of steps and vectorized chunks;
- :mod:`.round_engine`: the client life cycle (start, fold in the update, drop a NaN
  update), the round's all-reduce, aggregation and the federated callbacks' hook order;
- :mod:`.driver`: the callback that finishes clients after their last optimizer step,
  logs the round's summaries and carries the federated state in checkpoints;
- :mod:`.federated_state`: what a checkpoint holds, and the federation check on resume;
- :mod:`.rounds`: the per-round iterables that Lightning's loops consume, over the
  schedules of :mod:`.schedule`;
- :mod:`.vectorized`: vectorized clients (``vectorize=True``): set-up and chunks; the step in
  :mod:`.vectorized_step`;
  with :mod:`.vectorized_checks` (what is refused), :mod:`.stacked_optimizer` (torch.optim's
  functional rules over stacked state, per-client clipping), :mod:`.client_dropout`,
  :mod:`.stacked_batches`, and :mod:`.packed` / :mod:`.compiled` (data on the device,
  ``torch.compile``);
- :mod:`.evaluation` and :mod:`.client_evaluation`: per-client validation and test, and
  their summaries;
- :mod:`.composition`: which plugin pairs are refused at setup;
- :mod:`.collectives`: every collective of the engine and its plugins, through the run's
  transport (``torch.distributed``, or a recipe's, as ``lightning_fl.flower``'s); with
  :mod:`.round_metrics` (the training metrics inside the round's sum) and, in silo mode,
  :mod:`.site_log` (each site's own line per round);
- helpers shared with the plugins: :mod:`.client_store`, :mod:`.tensors`,
  :mod:`.seeding`, :mod:`.local_training`, :mod:`.divergence`, :mod:`.progress`,
  :mod:`.outputs`.
"""
