"""Drafters: cheap proposers of the tokens a target model will verify."""
