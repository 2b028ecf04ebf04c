"""Local files: opened (regular files only), mapped, and the page cache they sit in."""
