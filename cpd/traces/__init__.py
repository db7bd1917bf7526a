"""One trace module for every command: readers (Mooncake JSONL, Claude Code, Azure CSV) with
format detection, the conversion to token blocks, and the one arrival model of live and simulated
replay. ``read_trace`` → ``build_schedule`` → ``ReplayRequest`` list."""
from .arrivals import DEFAULT_TICK_MS, arrival_times, poisson_starts
from .blocks import BlockTokens, Vocab, block_key, shrink, vocab_from_model_card, vocab_from_tokenizer
from .errors import TraceFormatError
from .model import Subagent, Trace, TraceRequest, TraceSession
from .readers import detect_format, read_azure, read_claude_code, read_mooncake, read_trace
from .replay import KINDS, ReplayOptions, ReplayRequest, build_schedule, options_record, sim_blocks

__all__ = ["DEFAULT_TICK_MS", "arrival_times", "poisson_starts", "BlockTokens", "Vocab", "block_key", "shrink",
           "vocab_from_model_card", "vocab_from_tokenizer", "TraceFormatError", "Subagent", "Trace",
           "TraceRequest", "TraceSession", "detect_format", "read_azure", "read_claude_code", "read_mooncake",
           "read_trace", "KINDS", "ReplayOptions", "ReplayRequest", "build_schedule", "options_record", "sim_blocks"]
