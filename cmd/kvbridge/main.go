// Command kvbridge is a disaggregated prefill/decode LLM server with KV-cache transfer.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "kvbridge: under construction")
	os.Exit(2)
}
