"""What the user sees and types: shared flags, progress, images, start-up timing, `genfast info`."""
