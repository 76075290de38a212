// Package multiturn is kvbridge's multi-turn chat benchmark, a re-implementation of vLLM's
// benchmarks/multi_turn/benchmark_serving_multi_turn.py: clients replay conversations against
// an OpenAI-compatible /v1/chat/completions endpoint, each request carrying the conversation so
// far (with the server's real earlier answers), and the package reports per-request TTFT, TPOT,
// latency and token counts with the same summary statistics as the original.
//
// Input is either a generator config ("filetype": "generate_conversations", see ParseGenConfig
// and Generate) or a ShareGPT-style list of conversations (see ParseShareGPT); ReadInput reads
// either. Run drives the clients; Summarize and WriteReport build and print the summary.
//
// Differences from the Python original, all deliberate:
//   - Clients are goroutines, not processes; each has its own random source seeded seed+id+1.
//   - The random draws come from Go's PCG generator, so a given seed yields different (but
//     equally distributed and reproducible) conversations than numpy would.
//   - Text files that do not exist are replaced by the text embedded in this package (see
//     DefaultText), and text that is too short for the requested token counts is reused from
//     its start; both are reported as notices instead of failing.
//   - When the model's tokenizer cannot be loaded, token counts are estimated as one token per
//     four characters, and the report says so.
//
// The embedded text (opticks.txt) is the Second Book of Sir Isaac Newton's Opticks (fourth
// edition, 1730), a public-domain work, taken from the Project Gutenberg copy in the Go source
// tree (src/testdata/Isaac.Newton-Opticks.txt) with italics underscores and illustration markers
// removed.
//
// See docs/architecture.md for where the package sits among kvbridge's packages.
package multiturn
