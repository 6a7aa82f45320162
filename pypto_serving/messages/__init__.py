"""Messages, one module per receiver (scheduler, tokenizer, request) plus the pipe's
(worker): leaves that import nothing of ours above them, so two actors that talk both ways
never import each other."""
