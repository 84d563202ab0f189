"""Model definitions, textbook-plain `nn.Module`s; paging, graphs and parallelism live around them."""
