"""The node-local disk tier of weights: objects as sparse files shared by every process on
the node, their chunk markers, the byte-range locks that guard them, and its budget."""
