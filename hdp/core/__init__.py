"""The step stack both doors run: the round core, the step sequence, the planner object, the options both
doors share, the memory measure, checkpoints' atomic slots and fit check, Megatron's attention spec.

The library's engine (`hdp.trainer.engine`) and verl's (`hdp.integrations.verl.engine`) each build it once
through `hdp.core.stack.build_steps` and supply only what is their own (validation, the loss adapter,
outputs).  Modules: `rounds` (the round core, the only caller of Megatron's schedules), `step` (the step
sequence), `planning` (the one planner object), `options` (`HdpOptions`), `plan_ahead`, `phases`, `memory`,
`optim_state`, `agreement`, `checkpoint`, `attention_spec` / `attention_config` (hdp's core attention in
Megatron's layer spec), `stack` (the builder).  Imported module by module: nothing is re-exported here.
"""
