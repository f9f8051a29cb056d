"""``epd plan``: size the pools (``e:N,p:M,d:K``) for a workload and TTFT/ITL SLOs.

After Dynamo's SLA planner (ai-dynamo/dynamo, ``components/planner``: a pre-deployment
profile of prefill TTFT against input length and of decode ITL against the batch's KV load,
then replica counts from the predicted load; its virtual connector is the model of
``--connector local``), with DistServe's (OSDI'24) placement search: a simulation of the
workload's arrivals through each candidate placement, keeping the smallest that meets the
SLOs.

- ``epd plan profile --url URL --out profile.json`` measures a running server's real
  workers (:mod:`epd.ops.plan.profile`) into a profile of fits (:mod:`epd.ops.plan.fit`);
- ``epd plan recommend --profile profile.json (--trace PATH | --isl-mean N --osl-mean N
  --rate R) --ttft-slo S --itl-slo S`` simulates the workload's arrivals
  (:mod:`epd.ops.plan.workload`; the trace's recorded times, rescaled to ``--rate`` when
  given, or gamma arrivals of coefficient ``--cv``) through each candidate
  (:mod:`epd.ops.plan.simulate`) and prints the smallest that meets the SLOs at p90
  (:mod:`epd.ops.plan.recommend`); ``--apply`` sets the replicas (:mod:`epd.ops.plan.apply`);
- ``epd plan correct --profile profile.json --url URL --window 60`` fits correction factors
  to the server's live traffic (:mod:`epd.ops.plan.correct`).

:mod:`epd.ops.plan.cli` is the subcommand; :class:`~epd.ops.plan.errors.PlanError` the error
of every step (exit code 2). Import names from their modules (the package exports none: its
modules ``simulate``, ``recommend`` and ``apply`` share their names with functions).
"""
