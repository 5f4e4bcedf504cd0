"""The curvature: EK-FAC factors, preconditioning, the eigenbasis index plan and the refined
inverse-Hessian-vector product."""
