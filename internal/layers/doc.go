// Package layers holds no code: its test, layers_test.go, checks the import graph of every
// kvbridge package against the layering of docs/architecture.md ("Packages, and who may import
// whom") and fails naming each import the table does not allow.
package layers
