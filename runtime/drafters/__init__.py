"""Drafters: one interface (drafters.base.Drafter), three ways to propose tokens."""
