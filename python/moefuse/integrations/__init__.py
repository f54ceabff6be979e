"""moefuse inside other frameworks: `import moefuse.integrations.transformers` registers the
experts backend "moefuse" with Hugging Face transformers (docs/PYTHON.md, "transformers")."""
