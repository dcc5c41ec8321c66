"""Planning: what runs where and when, in pure Python (no TensorFlow; a test keeps it so).

`schedules` (each method's task lists), `policies` (weight rules: which
weights a task reads), `tasks` (what a stage runs for each task under a
policy: the table every executor reads), `verify` (every task once, dependencies, bounded links,
memory on paper), `windows` (a schedule cut into the compiled executor's
windows), `simulator` and `analytic` (timings on paper), `balance` (stage
boundaries from layer costs), `names` (checked option names).
"""
