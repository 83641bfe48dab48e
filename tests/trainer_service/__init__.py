"""Tests of trainer_service: loss against a dense oracle, golden figures, distributed step."""
