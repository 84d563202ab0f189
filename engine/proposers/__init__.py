"""Proposers: one interface (`Proposer`), one sampling path, three kinds (draft_model, mtp, ngram)."""
