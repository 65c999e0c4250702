"""The supervisor's decisions: a pure state machine over events, its rules, training health, goodput."""
