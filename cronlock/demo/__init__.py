"""The example domain: the article's daily digest."""
