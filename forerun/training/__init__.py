"""Training of drafting components on a frozen base model (Medusa heads)."""
