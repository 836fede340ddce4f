"""widedp."""
