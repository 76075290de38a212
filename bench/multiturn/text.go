package multiturn

import _ "embed"

//go:embed opticks.txt
var defaultText string

// DefaultTextName names the embedded text in notices and reports.
const DefaultTextName = "opticks.txt (embedded: Newton's Opticks, Second Book, public domain)"

// DefaultText returns the filler text embedded in kvbridge: the Second Book of Newton's Opticks
// (public domain, about 177 kB). It stands in for text files that do not exist.
func DefaultText() string { return defaultText }
