"""Where sinks are beyond the first token: every sinking position (``every_sink``) and Sink_1 against context
length (``context_length``)."""
