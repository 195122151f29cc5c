"""Training data made by the target itself: its answers to self-written
requests (Magpie), accumulated in token manifests (:mod:`forerun.corpus`).
Each drafter trains in its own package (:mod:`forerun.drafters.eagle`,
:mod:`forerun.drafters.medusa`)."""
