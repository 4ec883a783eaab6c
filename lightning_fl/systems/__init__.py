"""The papers' mathematics, apart from the engine that runs rounds.

Each module implements one family of systems and cites its paper's sections and
equations; the plugins in ``lightning_fl.callbacks`` connect them to the round.
From the engine they use only its seeding (:mod:`lightning_fl.engine.seeding`).

- client sampling and clustered sampling: :mod:`.samplers`;
- availability and CA-Fed: :mod:`.availability`, :mod:`.ca_fed`;
- asynchronous FL and the simulated clock: :mod:`.asynchrony`;
- decentralized FL, overlays and cycle times: :mod:`.topology` (underlays in networks/);
- personalization: FedEM mixtures :mod:`.mixture`, kNN-Per datastores :mod:`.datastore`;
- data streams and cache rules: :mod:`.streams`; online mixtures: :mod:`.fem_omd`;
- federated unlearning (SIFU): :mod:`.unlearning`;
- reference-data privacy: WERM :mod:`.werm`, membership inference :mod:`.membership`;
- user-level DP's accounting :mod:`.user_dp`, where privacy noise comes from
  :mod:`.privacy_noise`, the distributed discrete Gaussian :mod:`.discrete_gaussian`;
  secure aggregation's masks :mod:`.pairwise_masking`, signed keys :mod:`.key_signatures`,
  and the protocol that survives dropped sites :mod:`.double_masking`.
"""
