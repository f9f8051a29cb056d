"""Starting a deployment: ``epd launch`` (router, HTTP API and every worker on this host)
and ``epd serve`` (router and HTTP API; workers join from any host).

Modules:

- :mod:`epd.launch.config`: :class:`~epd.launch.config.LaunchConfig`, the validated
  settings of one ``epd launch`` / ``epd serve``, and the choices of their flags.
- :mod:`epd.launch.spec`: ``--pools`` / ``--tp`` parsed into a launch plan of
  :class:`~epd.launch.spec.PoolSpec`.
- :mod:`epd.launch.supervisor`: the worker processes of a plan (start, restart, stop,
  no orphans).
- :mod:`epd.launch.ports`: whether a TCP port can be listened on.
- :mod:`epd.launch.api_process`: the API process: router, workers, HTTP server.

Which settings type is for what (each is built from the one before it; none holds the
same fields for the same purpose as another):

============================================  ==========================================================
``epd.launch.config.LaunchConfig``            one ``epd launch`` / ``epd serve``, in the flags' own units
                                              (MiB, comma-separated lists); torch-free, so ``epd --help``
                                              stays fast. Its field defaults are the flags' defaults.
``epd.launch.spec.PoolSpec``                  one pool of the launch plan: role, devices, TP size.
``epd.api.server.ApiSettings``                the HTTP front end's limits, in bytes and tuples
                                              (``api_process.api_settings`` builds it from a LaunchConfig;
                                              tests build it directly).
``epd.encoders.media_limits.MediaLimits``     video sampling limits of the API's media processor.
``epd.workers.base.WorkerArgs``               one ``epd worker`` process (role, instance, router, keys,
                                              transfer settings, and the engine's keyword arguments);
                                              ``epd launch`` reaches it through the worker's command line
                                              (``LaunchConfig.forwarded_worker_args``).
``epd.config.EngineConfig``                   one engine instance (model, KV cache, batching), validated
                                              against the checkpoint; built by a worker from
                                              ``WorkerArgs.engine_kwargs`` and by ``epd.LLM``.
============================================  ==========================================================
"""
