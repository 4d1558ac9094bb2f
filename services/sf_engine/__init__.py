"""The engine worker: one inference engine behind NATS (``service``), and the engines it
can wrap (``backends``, each registered in ``ENGINE_BACKENDS``). Deployed apart from the
gateway, which reaches it only through the engine subjects
(``protocol.Subjects.engine_*``)."""
