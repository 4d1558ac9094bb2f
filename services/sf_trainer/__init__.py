"""trainer service: GRPO-family policy optimisation on batches from the trajectory service.

Read first: one step of training end to end is ``TrainerService._step``
(``sf_trainer.service``): the batch -> the learner's step -> publish the weights -> the
step's record (``sf_trainer.step.metrics_of``). The learner's step is
``sf_trainer.step.train_step``: advantages -> per micro-batch logprobs -> loss ->
backward -> optimizer step.

The modules: ``service`` (the loop and its NATS subjects), ``delivery`` (which batch is
next), ``slots`` (claiming and releasing training slots), ``history`` (what the streams
say was done), ``learner`` (the policy on every rank), ``step``, ``losses`` and
``advantages`` (plug-ins, each with its own settings: ``seamlessflow.plugin_settings``),
``logprobs`` and ``grpo`` (the math), ``distributed``, ``threads``, ``checkpoint``,
``evaluation``, ``schedule``, ``settings``, ``launch`` (several ranks).
"""
