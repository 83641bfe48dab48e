"""trainer_service package."""
