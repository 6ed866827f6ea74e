"""The engine: `LLMEngine` (schedule -> run -> update, with the speculative and
multi-step loops it hands over to), its configuration, the thread-safe `EngineCore`
that the servers drive (`DataParallelCore` over several replicas), fault handling,
output records, detokenization and memory sizing. Depends on core/, runner/, sample/
and spec_decode/; never on an entry point."""
