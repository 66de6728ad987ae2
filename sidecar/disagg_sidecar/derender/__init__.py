"""Client answers from what the engines returned: the coupled endpoints' shapes and usage, and the
chained derender (batch, per-chunk stream with coalescing, or a derender session) for a decode
engine that answers tokens."""
